"""BitTorrent data sets: chunk format, manifests, torrents, the libtorrent session and the sampler."""
