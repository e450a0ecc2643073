"""A training run driven step by step by a client (the Tinker API): the model and its losses."""
