"""NativeAuthenticator (learners sign up, an instructor approves them) as JupyterHub 6 runs it.

jupyterhub-nativeauthenticator 1.3.0, its latest release, times each login with the hub's `statsd` client, which
JupyterHub 6 no longer has: every login answers 500. Its login page also refuses the extra names JupyterHub passes
when it shows a login error. The login handler here mends both; the rest (sign-up, /hub/authorize, passwords) is
NativeAuthenticator's own, configured as `c.NativeAuthenticator.*`.
"""
from __future__ import annotations

from nativeauthenticator import NativeAuthenticator, handlers


class _NoTimer:
    """Stands in for the statsd client JupyterHub 6 dropped: timing a login does nothing."""

    def timer(self, *_args) -> _NoTimer:
        return self

    def start(self) -> _NoTimer:
        return self

    def stop(self, send: bool = True) -> None:
        pass


class LoginHandler(handlers.LoginHandler):
    @property
    def statsd(self) -> _NoTimer:
        return _NoTimer()

    def _render(self, login_error=None, username=None, **_ignored):
        return super()._render(login_error=login_error, username=username)


class WorkshopNativeAuthenticator(NativeAuthenticator):
    def get_handlers(self, app):
        return [(path, LoginHandler if handler is handlers.LoginHandler else handler)
                for path, handler in super().get_handlers(app)]
