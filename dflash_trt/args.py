"""The command line's argument parser: a usage error is one line, `<prog>: error: <what>` on stderr, exit 2,
like every other refusal of the CLI (argparse's default puts the whole usage block in front of it)."""
from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


GAMMA_HELP = "drafts per step, or auto (default): the width of most tokens per second, chosen per step"


def gamma_arg(text: str) -> int | None:
    """--gamma: "auto" -> None (chosen per step), else an integer (checked against the drafter where it is read)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma wants an integer or auto, got {text!r}") from None
