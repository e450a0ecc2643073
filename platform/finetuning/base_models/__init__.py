"""A new base model into the catalog (``manage.py add_base_model``): the folder checked, the weights
copied, the catalog's entry written. Only that command line uses it: neither the web process nor the
pool nor the workers import it."""
