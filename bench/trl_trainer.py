"""One epoch of TRL's SFTTrainer on the same rows as shardtune, at its fastest setting on CPU: packing with the
``bfd`` strategy (best-fit decreasing blocks of ``--pack_length`` tokens, padding-free rows with position ids),
completion-only loss (TRL's own ``completion_mask`` column, built from shardtune's labels: the summary tokens),
gradient checkpointing off (SFTConfig's default is on).
Single process, single device. Prints one JSON line; ``epoch_s`` is ``trainer.train()`` only.

    python -m bench.trl_trainer --model DIR --num_train 200 --num_validation 50 --pack_batch 2 --pack_length 512 \
        --lr 1e-3 --out DIR [--samsum F] [--chatter] [--device cpu|cuda] [--max_steps N]

On ``cuda`` the Trainer places the model and computes in bf16 mixed precision, as shardtune does by default.

Needs ``pip install shardtune[bench]`` (trl, pinned).
"""

from __future__ import annotations

import json
import math
import time

from bench.data import peer_inputs, peer_parser, peer_training_arguments


def main() -> None:
    ap = peer_parser(__doc__)
    ap.add_argument("--pack_batch", type=int, required=True, help="packed blocks per step")
    ap.add_argument("--pack_length", type=int, required=True, help="tokens per packed block (TRL's max_length)")
    args = ap.parse_args()
    start = time.perf_counter()

    import trl
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from bench.data import eval_loss_of
    from shardtune.model.loss import IGNORE_INDEX

    tokenizer, train_examples, eval_examples, model = peer_inputs(args)
    # shardtune's rows, tokenised once: TRL takes them as processed (input_ids) and builds labels from the
    # completion mask itself (completion_only_loss)
    rows = [
        {"input_ids": e["input_ids"], "completion_mask": [int(x != IGNORE_INDEX) for x in e["labels"]]}
        for e in train_examples
    ]
    config = SFTConfig(
        **peer_training_arguments(args, args.pack_batch),
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        max_length=args.pack_length,
        completion_only_loss=True,
        dataset_num_proc=None,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    computed = {"tokens": 0, "label_tokens": 0}
    collate = trainer.data_collator

    def counting_collator(features):  # what the model computes on, and the tokens the loss counts
        batch = collate(features)
        computed["tokens"] += batch["input_ids"].numel()
        computed["label_tokens"] += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        return batch

    trainer.data_collator = counting_collator
    tick = time.perf_counter()
    output = trainer.train()
    epoch_s = time.perf_counter() - tick
    loss = eval_loss_of(model.cpu(), eval_examples, tokenizer.pad_token_id)
    print(
        json.dumps(
            {
                "epoch_s": epoch_s,
                "steps": output.global_step,
                "examples": len(rows),
                "label_tokens": computed["label_tokens"],
                "computed_tokens": computed["tokens"],
                "eval_loss": loss,
                "eval_ppl": math.exp(loss),
                "process_s": time.perf_counter() - start,
                "train_loss": output.training_loss,
                "trl": trl.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
