"""Bounds on everything that arrives from the network, checked before any allocation."""

from __future__ import annotations

from dataclasses import dataclass

from crowdtrain.protocol.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
# A data set's .torrent: its piece hashes (20 bytes per piece: 0.4 MB for 5 GB in 256 KiB pieces, 0.5 MB for
# 100 GB in 4 MiB pieces) and file list. Refused above this everywhere: when made, published, registered
# and downloaded. In base64 inside a RunCreate it stays under the tracker's default 4 MiB request body.
MAX_TORRENT_BYTES = 3 * MiB
# A data set's tokenizer (``tokenizer.json``, Hugging Face ``tokenizers``): a byte-level BPE of 65536 tokens is
# about 2 MiB, Llama 3's (128k tokens) 9 MiB. Refused above this when made, published, stored and downloaded.
MAX_TOKENIZER_BYTES = 16 * MiB
# The same in base64, as ``RunCreate.tokenizer`` carries it: the room the tracker gives a RunCreate beyond its
# ``max_body_bytes`` (only after the admin token is checked), so a run's tokenizer fits any tracker.
MAX_TOKENIZER_BASE64 = 4 * ((MAX_TOKENIZER_BYTES + 2) // 3)


@dataclass(frozen=True, slots=True)
class Limits:
    """Largest inputs a decoder accepts. The defaults suit models up to ~1B parameters."""

    max_json_bytes: int = 1 * MiB  # one control message
    max_frame_bytes: int = 64 * MiB  # one tensor frame body, encoded or raw
    max_elements: int = 16 * MiB  # elements in one frame (64 MiB of fp32)
    max_ndim: int = 8

    def __post_init__(self) -> None:
        for name in ("max_json_bytes", "max_frame_bytes", "max_elements"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be a positive number of bytes or elements")
        if not 1 <= self.max_ndim <= 8:
            raise ConfigError("max_ndim", "must be between 1 and 8")


DEFAULT_LIMITS = Limits()
