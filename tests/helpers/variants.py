"""The NTL settings that the equivalence checks run: every registered variant (read from the registry, so a new
variant is covered without editing them), with reweigh off and, where the variant takes it, on."""

from __future__ import annotations

from ntl_pretrain.loss import VARIANTS, NTLSettings


def every_variant_settings(*extra: NTLSettings) -> list[NTLSettings]:
    """`NTLSettings` of each registered variant with its defaults, reweigh off and on (where allowed), then
    `extra`."""
    settings = []
    for variant in VARIANTS:
        for reweigh in (False, True):
            try:
                settings.append(NTLSettings(variant=variant, reweigh=reweigh))
            except ValueError:  # a variant that refuses reweigh (del, digit_entropy)
                assert reweigh, variant
    return settings + list(extra)
