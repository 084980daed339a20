"""Errors raised for bad input to the policy core; messages name the offending value."""


class MarconiError(ValueError):
    """Base class: bad input to the cache policy, a profile or a trace."""


class ProfileError(MarconiError):
    """Unknown profile name or a model config that cannot be interpreted."""


class TraceError(MarconiError):
    """A malformed trace line; the message names the file and line number."""
