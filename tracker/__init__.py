"""The tracker service: runs, BitTorrent announce, volunteers, progress, matchmaking. Never imports torch."""
