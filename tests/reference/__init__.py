"""Independent references the tests compare against: torch.nn modules with copied weights, hand computations."""
