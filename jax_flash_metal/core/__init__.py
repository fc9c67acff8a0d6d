"""The rules every implementation shares: the primitive contract, argument checks, visibility,
score features and NaN placement."""
