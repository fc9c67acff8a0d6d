"""Helpers of the command-line programs: help formatting, progress, the roofline model."""
