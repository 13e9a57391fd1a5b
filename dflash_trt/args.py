"""The command line's argument parser: a usage error is one line, `<prog>: error: <what>` on stderr, exit 2,
like every other refusal of the CLI (argparse's default puts the whole usage block in front of it)."""
from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")
