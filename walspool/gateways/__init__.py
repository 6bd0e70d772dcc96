"""The released gateways' stores mapped onto what walspool's parts need of them."""
