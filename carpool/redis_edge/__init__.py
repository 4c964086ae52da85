"""The Redis edge: carpool's own keys and the scripts that move requests through them."""
