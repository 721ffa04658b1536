"""verl adapter for weightsync (see README, "verl integration")."""
