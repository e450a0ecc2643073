"""The sign-in page: Django's, with attempts limited (``accounts.sign_in_attempts``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse

from accounts import sign_in_attempts


class SignInView(LoginView):
    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        exceeded = sign_in_attempts.attempt(request.POST.get("username", ""), request.META.get("REMOTE_ADDR", ""))
        if exceeded is None:
            return super().post(request, *args, **kwargs)
        # An unbound form: a bound one would check the password, which is what is being refused.
        form = self.form_class(request=request, initial={"username": request.POST.get("username", "")})
        context = self.get_context_data(form=form, refused=sign_in_attempts.refusal_message(exceeded))
        return self.render_to_response(context, status=429, headers={"Retry-After": str(exceeded.retry_after_s)})

    def form_valid(self, form: AuthenticationForm) -> HttpResponse:
        sign_in_attempts.succeeded(self.request.POST.get("username", ""), self.request.META.get("REMOTE_ADDR", ""))
        return super().form_valid(form)
