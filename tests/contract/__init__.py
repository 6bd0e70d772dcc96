"""The contract suite: each promise of README's "What it guarantees", once, black-box,
through the plugin, on each of the three released gateways in its own environment."""
