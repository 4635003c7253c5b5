"""Wire layer: control-message schemas, tensor frames, codecs, limits, signatures and errors.

Imports only the standard library, numpy, zstandard, msgspec and cryptography.
"""
