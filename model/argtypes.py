"""argparse types shared by the model's commands (model/cli.py and the eval / train commands): an int
or float in a range, with a message naming what the range means."""
from __future__ import annotations

import argparse


def int_in(lo: int, hi: int | None, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({what})") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range: {what}")
        return v
    parse.__name__ = "int"
    return parse


def float_in(lo: float, hi: float | None, what: str, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number ({what})") from None
        if v != v or v < lo or (lo_open and v == lo) or (hi is not None and v > hi) or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what}")
        return v
    parse.__name__ = "float"
    return parse
