"""crowdtrain: train one PyTorch model together with strangers' machines, the way BitTorrent shares a file."""

__version__ = "0.1.0"
