"""The command line the tests' reference scripts share (torch_reference_train.py, peft_eval.py):
`SCRIPT COMMAND ARGS...` runs one of the script's commands; `SCRIPT batch FILE` runs the commands
FILE lists (a JSON list of argument lists, each as the command line takes it) in order in this one
process, so that a test pays the seconds of importing torch, transformers and PEFT once rather than
per command. A failing command stops the batch, naming it; the later ones do not run.

`SCRIPT batch -` reads FILE's path from standard input: a test starts the script when it begins,
so that the imports run while memrt trains, and names the file once it has queued the commands (an
empty input, a test that never ran its batch, ends the script doing nothing)."""
import json
import sys


def main(commands, doc, argv):
    if not argv or (argv[0] not in commands and argv[0] != "batch") or (argv[0] == "batch" and len(argv) != 2):
        sys.exit(doc)
    if argv[0] != "batch":
        commands[argv[0]](*argv[1:])
        return
    path = sys.stdin.readline().strip() if argv[1] == "-" else argv[1]
    if not path:
        return
    with open(path) as f:
        batch = json.load(f)
    for k, command in enumerate(batch):
        try:
            main(commands, doc, command)
        except BaseException:
            print(f"{path}: command {k + 1} of {len(batch)} failed: {' '.join(command)}", file=sys.stderr)
            raise
