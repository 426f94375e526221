from .jinja import render, template_inputs_digest

__all__ = ["render", "template_inputs_digest"]
