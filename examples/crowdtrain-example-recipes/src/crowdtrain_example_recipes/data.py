"""A toy data set for ``example-cnn``: synthetic 8×8 "digits", the same bytes on every machine.

    python -m crowdtrain_example_recipes.data digits.npz [--samples 2048] [--seed 0]

writes a ``.npz`` with ``x`` float32 ``(N, 1, 8, 8)`` and ``y`` int64 ``(N,)``: each sample is one of ten 5×7
glyphs (0 to 9) at a random place on the 8×8 grid, with a random brightness and Gaussian noise. ``crowdtrain
dataset make digits.npz --out data/digits`` turns it into an ``arrays`` data set.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

GLYPHS = [
    # 0      1        2        3        4        5        6        7        8        9
    (".###.", "..#..", ".###.", "####.", "...#.", "#####", "..##.", "#####", ".###.", ".###."),
    ("#...#", ".##..", "#...#", "....#", "..##.", "#....", ".#...", "....#", "#...#", "#...#"),
    ("#..##", "..#..", "....#", "....#", ".#.#.", "####.", "#....", "...#.", "#...#", "#...#"),
    ("#.#.#", "..#..", "...#.", ".###.", "#..#.", "....#", "####.", "..#..", ".###.", ".####"),
    ("##..#", "..#..", "..#..", "....#", "#####", "....#", "#...#", ".#...", "#...#", "....#"),
    ("#...#", "..#..", ".#...", "....#", "...#.", "#...#", "#...#", ".#...", "#...#", "...#."),
    (".###.", ".###.", "#####", "####.", "...#.", ".###.", ".###.", ".#...", ".###.", ".##.."),
]  # fmt: skip
CLASSES = 10


def glyph(digit: int) -> np.ndarray:
    """The 7×5 bitmap of ``digit`` (1.0 where the stroke is)."""
    return np.array([[c == "#" for c in row[digit]] for row in GLYPHS], dtype=np.float32)


def make_digits(samples: int = 2048, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``x`` float32 ``(samples, 1, 8, 8)``, ``y`` int64 ``(samples,)``, from ``seed`` alone."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=samples).astype(np.int64)
    x = np.zeros((samples, 1, 8, 8), dtype=np.float32)
    rows = rng.integers(0, 8 - 7 + 1, size=samples)  # where the 7×5 glyph sits on the 8×8 grid
    cols = rng.integers(0, 8 - 5 + 1, size=samples)
    brightness = rng.uniform(0.6, 1.4, size=samples).astype(np.float32)
    bitmaps = [glyph(d) for d in range(CLASSES)]
    for i in range(samples):
        r, c = rows[i], cols[i]
        x[i, 0, r : r + 7, c : c + 5] = bitmaps[y[i]] * brightness[i]
    x += rng.normal(0.0, 0.3, size=x.shape).astype(np.float32)
    return x, y


def write_digits(path: str | Path, samples: int = 2048, seed: int = 0) -> Path:
    """Write :func:`make_digits` to ``path`` (a ``.npz`` with ``x`` and ``y``) and return the path."""
    path = Path(path)
    x, y = make_digits(samples, seed)
    with path.open("wb") as f:  # a file object: np.savez would otherwise append .npz to another suffix
        np.savez(f, x=x, y=y)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m crowdtrain_example_recipes.data",
        description="Write synthetic 8x8 digits (x float32 (N,1,8,8), y int64 (N,)) to a .npz file.",
    )
    parser.add_argument("out", type=Path, help="the .npz file to write")
    parser.add_argument("--samples", type=int, default=2048, help="number of samples (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    ns = parser.parse_args(argv)
    if ns.samples < 1:
        parser.error("--samples must be at least 1")
    out = write_digits(ns.out, ns.samples, ns.seed)
    print(f"wrote {out}: {ns.samples} samples, x float32 ({ns.samples}, 1, 8, 8), y int64 ({ns.samples},)")


if __name__ == "__main__":
    main()
