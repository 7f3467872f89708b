"""What the ServerApp and the ClientApps share, and neither owns: the run settings, the wire protocol, the data
splits and the restriction of the global model to a client's width. ``server`` and ``client`` import it, never each
other."""
