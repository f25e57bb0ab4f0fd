"""Client library running inside an inference worker; imported as ``kvpool.client``; needs torch.

Importing this package does not import torch: only its modules
(:mod:`kvpool.client.hbm`, :mod:`kvpool.client.devices`, ...) do, so
``import kvpool.client`` works on machines without torch.
"""
