pytest_plugins = ['equivalence.testing']  # devices and warning filters, before anything imports JAX
