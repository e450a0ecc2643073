"""OpenAI's graders (string_check, text_similarity, score_model, label_model, multi), one engine for
everything on the platform that scores an answer. Django-free; the similarity libraries are imported
only when a metric is computed, so importing this package stays cheap for the web process.

- ``spec``: a tenant's grader checked (OpenAI's fields, strict types, limits) and kept with defaults.
- ``template``: ``{{item.x}}`` / ``{{sample.x}}`` references substituted as text, never evaluated.
- ``formula``: a multi grader's ``calculate_output``, by a whitelisting evaluator with bounds.
- ``similarity``: text_similarity's metrics (rapidfuzz, nltk, rouge-score).
- ``judging``: a model grader's request to its judge model, and reading the judge's reply.
- ``engine``: ``grade``, a grader applied to an item and a sample, giving a ``Result``.
- ``result``: ``Result`` (score, passed, details), shared by ``judging`` and ``engine``.
"""
