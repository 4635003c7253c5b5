"""Wire layer: control-message schemas, tensor frames, codecs, limits, signatures and errors.

Imports only the standard library, numpy, zstandard, msgspec, cryptography and aiohttp (the tracker client,
the servers' listening sockets); never another crowdtrain layer.
"""
