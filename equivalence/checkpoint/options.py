"""The checkpoint flags of ``python -m equivalence.run``, and their validation (imports no JAX)."""

import argparse
import dataclasses
import os

from equivalence.core.port.config import ConfigError
from equivalence.core.port.plan import Run


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    resume_at: int | None = None  # N: legacy saves at step N, NNX resumes from the migrated checkpoint
    directory: str | None = None  # DIR: legacy checkpoints in DIR/legacy, the migrated one in DIR/nnx; None: temporary
    every: int | None = None  # calls between legacy saves; default: N / K with resume_at, else every call
    keep: int = 3  # the last legacy checkpoints kept (the one NNX resumes from is always kept)

    @property
    def requested(self) -> bool:
        return self.resume_at is not None or self.directory is not None or self.every is not None

    @property
    def saves(self) -> bool:
        return self.resume_at is not None or self.directory is not None

    def save_every(self, config: Run) -> int:
        """Calls between two legacy saves."""
        if self.every is not None:
            return self.every
        return self.resume_at // config.steps_per_call if self.resume_at else 1

    def calls_to_run(self, config: Run) -> int:
        """Compiled calls of both paths together: NNX starts at the checkpoint."""
        return 2 * config.calls - (self.resume_at or 0) // config.steps_per_call

    def check(self, config: Run, several: bool = False) -> None:
        """Bad flags -> ``ConfigError`` (one line, exit 2), before any work. ``several``: the run
        has several processes, which must save into one folder that every one of them sees."""
        if several and self.resume_at is not None and self.directory is None:
            raise ConfigError(
                '--resume-at with several processes needs --checkpoint-dir DIR, a folder every process sees '
                '(each would make a temporary folder of its own, and their joint save would never complete)'
            )
        if self.every is not None and self.every < 1:
            raise ConfigError(f'--checkpoint-every must be at least 1, got {self.every}')
        if self.keep < 1:
            raise ConfigError(f'--keep-checkpoints must be at least 1, got {self.keep}')
        if self.every is not None and not self.saves:
            raise ConfigError('--checkpoint-every needs --checkpoint-dir or --resume-at')
        if self.resume_at is not None:
            _check_resume_at(self.resume_at, config, self.save_every(config))
        if self.directory is not None:
            _check_directory(self.directory)


def _check_resume_at(n: int, config: Run, every: int) -> None:
    k, steps = config.steps_per_call, config.steps
    if n < 1 or n % k or n >= steps:
        valid = [str(s) for s in range(k, steps, k)]
        choices = f'one of {", ".join(valid)}' if valid else f'none with --calls {config.calls}: use --calls 2 or more'
        raise ConfigError(
            f'--resume-at {n} must be a positive multiple of --steps-per-call {k} below the {steps} steps of the run '
            f'({choices})'
        )
    if (n // k) % every:
        raise ConfigError(
            f'--resume-at {n} is not a step the legacy run saves at: with --checkpoint-every {every} it saves every '
            f'{every * k} steps'
        )


def _check_directory(directory: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f'--checkpoint-dir {directory} is not a directory')
    for sub in ('legacy', 'nnx'):
        path = os.path.join(directory, sub)
        if os.path.isdir(path) and os.listdir(path):
            raise ConfigError(f'--checkpoint-dir {directory}: {path} is not empty; choose a new directory')


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        '--resume-at', type=int, default=None, metavar='N', help='legacy saves at step N; NNX resumes from it, migrated'
    )
    parser.add_argument(
        '--checkpoint-dir', default=None, metavar='DIR', help='legacy checkpoints in DIR/legacy, migrated in DIR/nnx'
    )
    parser.add_argument('--checkpoint-every', type=int, default=None, metavar='E', help='legacy saves every E calls')
    parser.add_argument('--keep-checkpoints', type=int, default=3, metavar='N', help='keep the last N (default 3)')


def from_args(args: argparse.Namespace) -> CheckpointOptions:
    return CheckpointOptions(args.resume_at, args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints)
