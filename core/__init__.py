"""Django-free pieces shared by the web platform, the workers and the inference pool."""
