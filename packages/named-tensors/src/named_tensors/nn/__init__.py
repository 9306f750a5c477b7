"""Neural-network layers on NamedArrays."""
