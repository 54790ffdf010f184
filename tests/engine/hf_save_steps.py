"""Where Hugging Face's Trainer saves checkpoints: the steps its DefaultFlowCallback asks to save at,
for each case of a JSON list, by running that callback over the training loop's step and epoch
ends as Trainer's inner loop calls them (tests/engine/test_checkpoints.cpp's oracle).

    python hf_save_steps.py CASES.json OUT.json
    CASES.json: [{"name": ..., "max_steps": M, "steps_per_epoch": S,
                  "save_strategy": "steps" | "epoch" | "no" (optional), "save_steps": N or a fraction (optional)}]
    OUT.json:   {name: [steps at which a checkpoint is saved, ascending]}
"""
import json
import math
import sys
import tempfile

from transformers import TrainingArguments
from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState


def save_steps_of(case, output_dir):
    kwargs = {k: case[k] for k in ("save_strategy", "save_steps") if k in case}
    args = TrainingArguments(output_dir=output_dir, max_steps=case["max_steps"], report_to="none", use_cpu=True,
                             **kwargs)
    state = TrainerState()
    state.max_steps = case["max_steps"]
    state.compute_steps(args, case["max_steps"])
    flow = DefaultFlowCallback()
    saved = []
    epochs = math.ceil(case["max_steps"] / case["steps_per_epoch"])
    for _ in range(epochs):
        control = TrainerControl()
        for _ in range(case["steps_per_epoch"]):
            state.global_step += 1
            control = flow.on_step_end(args, state, control)
            if control.should_save and state.global_step not in saved:
                saved.append(state.global_step)
            control.should_save = False
            if control.should_training_stop:
                break
        control = flow.on_epoch_end(args, state, control)
        if control.should_save and state.global_step not in saved:
            saved.append(state.global_step)
        if control.should_training_stop:
            break
    return saved


def main():
    cases = json.load(open(sys.argv[1]))
    with tempfile.TemporaryDirectory() as output_dir:
        out = {case["name"]: save_steps_of(case, output_dir) for case in cases}
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
