"""How st_ext's replacements of upstream losses keep upstream's calls, card and attributes.

A user swaps ``from sentence_transformers import losses`` for ``from st_ext import losses`` and
changes nothing else, so for every class st_ext replaces:

* every call that upstream accepts binds the same way here. Upstream changed the order of some
  constructors between releases (``CachedGISTEmbedLoss`` gained ``mini_batch_num_tokens`` before
  ``show_progress_bar`` in 5.x), so the order is read from the *installed* upstream class by
  :func:`follows_upstream_signature`, and st_ext's own options become keyword-only after it;
* the model card reads the same. sentence-transformers names a loss by its class's ``__module__``
  and ``__name__``, links to its documentation only when the module starts with
  ``sentence_transformers.``, lists ``get_config_dict()`` when the loss has one, and cites
  ``loss.citation`` when there is one. :func:`named_like_upstream` gives the class upstream's
  module, name and citation, and hides ``citation``/``get_config_dict`` where upstream has none.
  :func:`card_config` lists upstream's parameters, then st_ext's own options only when the user
  changed them.

Nothing here branches on version numbers: every fact is read from the upstream class itself.

The price of upstream's ``__module__``: ``repr(cls)`` shows upstream's path and ``inspect.getsource``
finds upstream's source. ``cls.st_ext_module`` names the real module (pickling uses it), and the
class docstrings say they are st_ext's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

#: Stands in for a cached loss while upstream's constructor of a wrapper runs its checks, so that it never sees,
#: warns about or decorates the cached loss itself.
PLACEHOLDER_LOSS = nn.Module
#: Constructor arguments that upstream's model cards never list.
NOT_IN_CARD = ("self", "model", "show_progress_bar")
#: The attributes through which the model card reads a loss.
CARD_ATTRIBUTES = ("citation", "get_config_dict")


# ---------------------------------------------------------------------------------------------
# Signatures


def upstream_parameters(upstream_class: type) -> list[inspect.Parameter]:
    """The parameters of ``upstream_class.__init__`` after ``self``."""
    return list(inspect.signature(upstream_class.__init__).parameters.values())[1:]


def upstream_default(upstream_class: type, name: str) -> Any:
    """The default of upstream's constructor argument ``name`` (e.g. a distance function, whose
    identity the installed release decides)."""
    return inspect.signature(upstream_class.__init__).parameters[name].default


def reordered_signature(own: inspect.Signature, upstream_class: type) -> inspect.Signature:
    """``own`` with upstream's positional parameters first, in upstream's order, and everything
    else keyword-only, in ``own``'s order.

    Where ``own`` takes ``**upstream_arguments``, upstream's parameters it does not declare are taken
    as upstream declares them (the installed release's defaults too). Otherwise raises TypeError at
    import when st_ext lacks one of upstream's parameters: a positional call would bind its later
    arguments to the wrong names.
    """
    own_parameters = {
        name: parameter for name, parameter in own.parameters.items() if parameter.kind is not parameter.VAR_KEYWORD
    }
    takes_the_rest = len(own_parameters) < len(own.parameters)
    self_parameter = next(iter(own_parameters.values()))
    positional, keyword_only = [self_parameter], []
    for parameter in upstream_parameters(upstream_class):
        if parameter.name not in own_parameters and not takes_the_rest:
            raise TypeError(
                f"st_ext's replacement of {upstream_class.__name__} does not take upstream's {parameter.name!r}."
            )
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        if parameter.kind is not kind:
            kind = inspect.Parameter.KEYWORD_ONLY
        target = positional if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else keyword_only
        target.append(own_parameters.get(parameter.name, parameter).replace(kind=kind))
    placed = {parameter.name for parameter in positional + keyword_only}
    keyword_only += [
        parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for name, parameter in own_parameters.items()
        if name not in placed
    ]
    return own.replace(parameters=positional + keyword_only)


def follows_upstream_signature(upstream_class: type) -> Callable[[Callable], Callable]:
    """Decorate an ``__init__`` so that it binds arguments exactly as ``upstream_class`` does: the one
    way st_ext's replacements take upstream's arguments.

    The decorated function is called with every argument by name (defaults filled in), so it may
    declare its parameters in any order; with ``**upstream_arguments`` it receives there those of
    upstream's it does not declare. Its own options that upstream lacks become keyword-only.
    """

    def decorate(init: Callable) -> Callable:
        signature = reordered_signature(inspect.signature(init), upstream_class)

        @functools.wraps(init)
        def __init__(*args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            init(**bound.arguments)

        __init__.__signature__ = signature
        __init__.__doc__ = init.__doc__ or upstream_class.__init__.__doc__
        return __init__

    return decorate


# ---------------------------------------------------------------------------------------------
# Model cards


class _Absent:
    """A class attribute that is not there: ``hasattr(loss, name)`` is False, as on the upstream
    class, even though a base class of st_ext's defines it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        raise AttributeError(f"{(owner or type(instance)).__name__} has no {self.name!r}, as upstream's has none.")


def _rebuild(module_name: str, qualified_name: str) -> Any:
    """Unpickle an instance of an st_ext class that is named like upstream's (see below)."""
    cls = importlib.import_module(module_name)
    for part in qualified_name.split("."):
        cls = getattr(cls, part)
    return cls.__new__(cls)


def _reduce_ex(self: Any, protocol: int) -> tuple:
    """Pickle by st_ext's own module: ``__module__`` names upstream's, where pickle would find
    upstream's class instead of this one."""
    cls = type(self)
    module = cls.__dict__.get("st_ext_module", cls.__module__)  # a user's subclass lives in its own module
    _, _, *state = object.__reduce_ex__(self, max(protocol, 2))
    return (_rebuild, (module, cls.__qualname__), *state)


def named_like_upstream(upstream_class: type) -> Callable[[type], type]:
    """Class decorator: the model card names, links and cites the class as it does ``upstream_class``.

    Sets ``__module__`` to upstream's (the card derives the name and the documentation link from
    it), keeps the real module in ``st_ext_module`` for pickling, uses upstream's ``citation``
    property, and hides ``citation``/``get_config_dict`` where upstream's class has none.
    """

    def decorate(cls: type) -> type:
        if cls.__name__ != upstream_class.__name__:
            raise TypeError(f"{cls.__name__} cannot be named like {upstream_class.__name__}.")
        cls.st_ext_module = cls.__module__
        cls.__module__ = upstream_class.__module__
        cls.__reduce_ex__ = _reduce_ex
        for name in CARD_ATTRIBUTES:
            if not hasattr(upstream_class, name):
                absent = _Absent()
                absent.__set_name__(cls, name)
                setattr(cls, name, absent)
        if hasattr(upstream_class, "citation"):
            cls.citation = inspect.getattr_static(upstream_class, "citation")
        return cls

    return decorate


def card_value(value: Any) -> Any:
    """How an option shows in the card: plain values and models as they are (the card formats
    models itself), anything else, such as a precomputed table, by its ``repr`` summary."""
    if isinstance(value, (bool, int, float, str, type(None), nn.Module)):
        return value
    return repr(value)


def is_default(value: Any, default: Any) -> bool:
    return value is default or (
        default is not inspect.Parameter.empty and type(value) is type(default) and value == default
    )


def card_config(loss: Any, upstream_class: type) -> dict[str, Any]:
    """``get_config_dict()`` as upstream's card lists it, then st_ext's own options that differ
    from their defaults.

    Upstream's config lists every constructor argument but the model and the progress bar, in
    constructor order, under the argument's name; the own options are the constructor arguments
    upstream does not take (including newer upstream options on an older upstream).
    """
    config = {
        parameter.name: getattr(loss, parameter.name)
        for parameter in upstream_parameters(upstream_class)
        if parameter.name not in NOT_IN_CARD
    }
    for name, parameter in inspect.signature(type(loss).__init__).parameters.items():
        if (
            name in config
            or name in NOT_IN_CARD
            or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        ):
            continue
        value = getattr(loss, name)
        if not is_default(value, parameter.default):
            config[name] = card_value(value)
    return config
