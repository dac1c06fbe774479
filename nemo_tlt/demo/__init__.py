"""The demo: one user of the framework, not part of it.

Synthetic long-tailed tasks (``tasks``), their character tokenizer
(``tokenizer``), outcome rewards (``rewards``), the SFT warm start (``sft``) and
the shipped demo models (``assets``, ``shipped_assets``, ``prepare``). The
framework reaches this package only through import-path strings in the config
(``task.source``, ``task.reward``, ``task.tokenizer``) and at entry points.
"""
