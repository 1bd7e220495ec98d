"""kvq.Error raised from the Python side, carrying a code as the C++ side's do."""
from ._kvq import Error


def error(message, code):
    """A kvq.Error with `message` and `code` (kvq::ErrorCodeName: 'invalid argument', ...)."""
    raised = Error(message)
    raised.code = code
    return raised
