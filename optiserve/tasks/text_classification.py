"""Text classification: a sequence classifier's [N, K] logits over its classes (config.json's
id2label, in index order), one row per text. Judged and answered as image classification is
(tasks/classification.py): top-1 against labels matched to the classes by name, with the paired
interval of its difference from fp32, or without such labels top-1 agreement with fp32; answered
with the top-k classes and their probabilities. A multi-label classifier's (its sigmoids: output kind
`multi_label`) is read as an image one's is (tasks/multi_label.py), its words counting texts."""

from __future__ import annotations

from optiserve.tasks.classification import Classification
from optiserve.tasks.multi_label import KIND, MultiLabelClassification
from optiserve.tasks.registry import register_reading, register_task


class TextClassification(Classification):
    name = "text-classification"
    description = "one [N, K] tensor of class logits per text (a sequence classifier)"
    input_kind = "text"
    unit = "texts"

    def judged_note(self, dataset, labelled, scored) -> str | None:
        if scored:
            return None
        why = "has no labels" if not labelled else "has labels that are not the model's classes (matched by name)"
        return (f"dataset {dataset} {why}: each variant is judged by how often its top-1 agrees with fp32's; it may "
                f"disagree on at most --max-accuracy-drop percent of the texts, the most its top-1 could fall")


register_task(TextClassification())


class TextMultiLabelClassification(MultiLabelClassification):
    name = TextClassification.name
    description = "one [N, K] tensor of K independent class probabilities per text (multi-label)"
    input_kind = "text"
    unit = "texts"


register_reading(KIND, TextMultiLabelClassification())
