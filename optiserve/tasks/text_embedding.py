"""Text embedding: a sentence encoder's pooled vectors [N, D], one per text. Judged as image
embeddings are (tasks/embedding.py): cosine similarity to fp32's vectors for the same texts, with
its interval, and nearest-neighbour agreement; answered with the vector."""

from __future__ import annotations

from optiserve.tasks.embedding import Embedding
from optiserve.tasks.registry import register_task


class TextEmbedding(Embedding):
    name = "text-embedding"
    description = "one [N, D] tensor of text vectors (search, retrieval, clustering)"
    input_kind = "text"

    def legend(self, manifest) -> str:
        return ("Cosine similarity of each text's vector to fp32's for the same text: the mean with its 95% "
                "bootstrap interval, and the 1st percentile; NN agree: how often a text's nearest neighbour among "
                "the held-out texts is the one fp32's vectors give. A variant is accepted when the mean is at least "
                f"{manifest.get('min_cosine', 0.99):g} (--min-cosine).")


register_task(TextEmbedding())
