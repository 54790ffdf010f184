"""sentencepiece models trained here (BPE and unigram, with byte fallback) and what sentencepiece's
own processor makes of the test texts of hf_tokenizers.py: the oracle of test_tokenizer.cpp's
sentencepiece test.

    sp_tokenize.py OUT_DIR
writes OUT_DIR/<bpe|unigram>/tokenizer.model and OUT_DIR/<kind>/expected.json:
    {"vocab_size": n, "bos": id, "eos": id, "texts": [...], "ids": [...] (EncodeAsIds),
     "decoded": [...] (DecodeIds of those ids)}
and OUT_DIR/unigram/tokenizer_config.json asking for an EOS too (add_eos_token).
"""
import json
import os
import random
import sys

import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tokenizers import SAMPLES, corpus  # noqa: E402


def main():
    out = sys.argv[1]
    rng = random.Random(11)
    lines = [l.replace("\n", " ").replace("\r", " ") for l in corpus(rng)]
    lines = [l for l in lines if l.strip()]
    texts = SAMPLES + ["".join(rng.choice("ab c\t 12 ,.'!你好😀é\u0301") for _ in range(rng.randint(0, 30)))
                       for _ in range(100)]
    for kind in ("bpe", "unigram"):
        d = os.path.join(out, kind)
        os.makedirs(d, exist_ok=True)
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=os.path.join(d, "tokenizer"),
                                       vocab_size=500, model_type=kind, byte_fallback=True, character_coverage=0.98,
                                       unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
        ids = [sp.encode(t) for t in texts]
        with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
            json.dump({"vocab_size": sp.get_piece_size(), "bos": sp.bos_id(), "eos": sp.eos_id(), "texts": texts,
                       "ids": ids, "decoded": [sp.decode(i) for i in ids]}, f, ensure_ascii=False)
    with open(os.path.join(out, "unigram", "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": True, "add_eos_token": True}, f)


if __name__ == "__main__":
    main()
