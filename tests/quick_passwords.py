"""The tests' password hasher: Django's PBKDF2 at one iteration instead of a million.

At a million iterations a password costs about half a second of a core, and every persona a test
creates has one: that was most of the quick lane's CPU time (py-spy, sampling its pytest process).
The algorithm is still ``pbkdf2_sha256`` and a hash carries its iteration count, so any Django
process (``bin/run``'s web, a test's) checks these hashes with its own default hashers.
"""

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class OneIterationPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1
