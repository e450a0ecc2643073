"""What several apps and the workers share: the Celery app, the database-outage translation, error
responses, the client of the serving backends, ... It imports no app (``tests/test_layering.py``),
so any app may import it. It holds no models: it is not a Django app."""
