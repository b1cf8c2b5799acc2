"""``python -m ema_pg COMMAND [ARGS]``: one entry point for every command; ``python -m ema_pg.COMMAND`` still works.

    python -m ema_pg                      # the commands, one line each
    python -m ema_pg train experiment=demo
    python -m ema_pg decide reproductions/reasoning_gym/suite/plan.yaml --status
"""

import runpy
import sys

from ema_pg.process import command_start

#: command -> what it does (each is the module ``ema_pg.<command>``)
COMMANDS = {
    "train": "train one run, or a Hydra multirun sweep (-m)",
    "evaluate": "evaluate a run's policy on its task's splits",
    "episode": "print one episode of a run's task: its turns, each span's loss mask, the reward",
    "export": "export a run's policy or anchor as a Hugging Face model folder",
    "decide": "decide pre-registered claims by a group-sequential plan",
    "pilot": "a pilot's pick (the splits a plan will ask on), by a rule registered before its first run",
    "reproduce": "one reproduction: its sweep at a scale, then its report",
    "reports": "the report of a finished sweep",
    "table2": "Table 2's writer",
    "table3": "Table 3's writer",
    "hpo": "an Optuna search over training runs",
    "runs": "list run folders: the settings they differ in, their scores (--where, --diff)",
    "track": "send run folders to a tracker (track import DIR --logger mlflow)",
    "byo": "write the bring-your-own examples of docs/byo.md",
    "lab": "the KL-estimator conformance lab: verdicts, or the report (--all)",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.splitlines()[0].replace("``", ""))
        for name, what in COMMANDS.items():
            print(f"  {name:<10} {what}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        print(f"python -m ema_pg: no command {name!r}{f'; did you mean {close[0]}?' if close else ''} "
              f"(the commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    command_start()  # before the command loads torch (each command module applies it too: idempotent)
    sys.argv = [f"-m ema_pg.{name}", *rest]  # what the command's parser and Hydra read as their name and arguments
    runpy.run_module(f"ema_pg.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
