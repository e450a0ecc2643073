"""Evaluations in the shape of OpenAI's Evals API: an eval (a file of examples and its graders) and
its runs (one model's answers to it, scored on a worker). See docs/api.md: Evaluations."""
