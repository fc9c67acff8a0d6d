"""The two primitives, their JAX rules and their custom partitioning."""
