"""How st_ext's replacements of upstream losses keep upstream's calls, model card and attributes.

Every fact is read from the installed upstream class, never from a version number: the order of
its constructor's arguments (``CachedGISTEmbedLoss`` gained ``mini_batch_num_tokens`` before
``show_progress_bar`` in 5.x), and what the card reads: the class's name, the full name that links its
documentation (upstream's, written by :mod:`st_ext.model_card`), ``get_config_dict()`` and ``citation``
where the class has them. The classes stay st_ext's own: ``__module__``, pickling and ``inspect`` name
st_ext's files.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from torch import nn

from st_ext.model_card import NAMESAKE_ATTRIBUTE

#: Stands in for a cached loss while upstream's constructor of a wrapper runs its checks, so that it never sees,
#: warns about or decorates the cached loss itself.
PLACEHOLDER_LOSS = nn.Module
#: Constructor arguments that upstream's model cards never list.
NOT_IN_CARD = ("self", "model", "show_progress_bar")
#: The attributes through which the model card reads a loss.
CARD_ATTRIBUTES = ("citation", "get_config_dict")

_Parameters = ParamSpec("_Parameters")
_Class = TypeVar("_Class", bound=type)


def upstream_parameters(upstream_class: type[Any]) -> list[inspect.Parameter]:
    """The parameters of ``upstream_class.__init__`` after ``self``."""
    return list(inspect.signature(upstream_class.__init__).parameters.values())[1:]


def upstream_default(upstream_class: type[Any], name: str) -> Any:
    """The default of upstream's constructor argument ``name`` (e.g. a distance function)."""
    return inspect.signature(upstream_class.__init__).parameters[name].default


def reordered_signature(own: inspect.Signature, upstream_class: type[Any]) -> inspect.Signature:
    """``own`` with upstream's positional parameters first, in upstream's order, and everything
    else keyword-only, in ``own``'s order.

    Where ``own`` takes ``**upstream_arguments``, upstream's parameters it does not declare are taken
    as upstream declares them. Otherwise a parameter of upstream's that ``own`` lacks raises TypeError
    at import: a positional call would bind its later arguments to the wrong names.
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
        declared = own_parameters.get(parameter.name, parameter)
        if parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
            positional.append(declared.replace(kind=parameter.POSITIONAL_OR_KEYWORD))
        else:
            keyword_only.append(declared.replace(kind=parameter.KEYWORD_ONLY))
    placed = {parameter.name for parameter in positional + keyword_only}
    keyword_only += [
        parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for name, parameter in own_parameters.items()
        if name not in placed
    ]
    return own.replace(parameters=positional + keyword_only)


def follows_upstream_signature(
    upstream_class: type[Any],
) -> Callable[[Callable[_Parameters, None]], Callable[_Parameters, None]]:
    """Decorate an ``__init__`` so that it binds arguments exactly as ``upstream_class`` does.

    The decorated function is called with every argument by name (defaults filled in), so it may
    declare its parameters in any order; with ``**upstream_arguments`` it receives there those of
    upstream's it does not declare. Its own options that upstream lacks become keyword-only. A type
    checker reads the decorated function's own parameters: declare them in the order upstream's newest
    release takes them, st_ext's own after ``*``.
    """

    def decorate(init: Callable[_Parameters, None]) -> Callable[_Parameters, None]:
        signature = reordered_signature(inspect.signature(init), upstream_class)

        @functools.wraps(init)
        def __init__(*args: Any, **kwargs: Any) -> None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"{upstream_class.__name__}: {error}") from None
            bound.apply_defaults()
            init(**bound.arguments)  # type: ignore[call-arg]

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        __init__.__doc__ = init.__doc__ or upstream_class.__init__.__doc__
        return cast("Callable[_Parameters, None]", __init__)

    return decorate


class _Absent:
    """A class attribute that is not there: ``hasattr(loss, name)`` is False, as on the upstream
    class, even though a base class of st_ext's defines it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        raise AttributeError(f"{(owner or type(instance)).__name__} has no {self.name!r}, as upstream's has none.")


def named_like_upstream(upstream_class: type[Any], note: str | None = None) -> Callable[[_Class], _Class]:
    """Class decorator: the model card names, links and cites the class as it does ``upstream_class``
    (:mod:`st_ext.model_card`), and ``citation``/``get_config_dict`` are hidden where upstream's class has none.
    With ``note``, the class's docstring is upstream's (4.x keeps it on ``__init__``) followed by what st_ext
    changes. The class itself is left st_ext's: its module, name and pickling are its own."""

    def decorate(cls: _Class) -> _Class:
        if cls.__name__ != upstream_class.__name__:
            raise TypeError(f"{cls.__name__} cannot be named like {upstream_class.__name__}.")
        if note is not None:
            cls.__doc__ = f"{upstream_class.__doc__ or upstream_class.__init__.__doc__ or ''}\n\n    st_ext: {note}\n"
        setattr(cls, NAMESAKE_ATTRIBUTE, upstream_class)
        for name in CARD_ATTRIBUTES:
            if not hasattr(upstream_class, name):
                setattr(cls, name, _Absent(name))
        if hasattr(upstream_class, "citation"):
            setattr(cls, "citation", inspect.getattr_static(upstream_class, "citation"))
        return cls

    return decorate


def card_config(loss: Any, upstream_class: type) -> dict[str, Any]:
    """``get_config_dict()`` as upstream's lists it (every constructor argument but the model and the
    progress bar, in order), then the constructor arguments upstream does not take (st_ext's own, and
    newer upstream options on an older upstream) where they differ from their defaults."""
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
        value, default = getattr(loss, name), parameter.default
        if value is default or (default is not parameter.empty and type(value) is type(default) and value == default):
            continue
        # Models as they are (the card formats them itself), anything but a plain value (a table) by its repr.
        config[name] = value if isinstance(value, (bool, int, float, str, type(None), nn.Module)) else repr(value)
    return config
