"""The released gateways' stores mapped onto what walspool's parts need of them."""

#: The attribute that marks what the plugin wrapped or linked, so nothing is done twice.
MARK = "__walspool__"
