"""One module per patch; :mod:`ampguard.registry` lists them."""
