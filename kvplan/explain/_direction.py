"""Which way each slot's bits move the predicted damage: SHAP values against bits.

The consensus importance (:mod:`kvplan.surrogates.importance`) says how much a slot matters,
not in which direction. Here a random forest on the same features (``log2`` bits per slot,
+0.3 for a corrected key slot, plus varied quantizer fields -> log-KL) is explained with
``shap.TreeExplainer``; a slot's *effect* is the least-squares slope of its SHAP values
against its feature: the change in predicted log-KL per doubling of its bits. Negative
means more bits lower the predicted KL, as they should.
"""

from __future__ import annotations

import warnings

import numpy as np

N_SCATTER = 4  # slots whose (bits, SHAP) pairs are kept for the scatter panel


def slot_direction(hist, q_fields, modalities, slots, seed: int = 0, n_estimators: int = 100) -> dict:
    """``{"slope": {slot: d log-KL / d log2(bits)}, "scatter": {slot: {"bits": [...], "shap": [...]}}}``
    for the slot names ``slots`` (``L03.H1.k.text``); slots whose bits never varied are left out."""
    import shap
    from sklearn.ensemble import RandomForestRegressor

    from ..plans import split_codes
    from ..surrogates import history_features, log_kl

    X, names = history_features(hist.codes, q_fields, modalities)
    y = log_kl(hist.kl)
    rf = RandomForestRegressor(n_estimators=n_estimators, max_features=0.5, random_state=seed).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sv = np.asarray(shap.TreeExplainer(rf).shap_values(X, check_additivity=False))
    bits, corrected = split_codes(hist.codes.reshape(len(hist), -1))
    col = {n[len("slot:"):]: j for j, n in enumerate(names) if n.startswith("slot:")}
    slope, scatter = {}, {}
    for s in slots:
        j = col[s]
        x = X[:, j]
        if x.std() == 0:
            continue
        slope[s] = float(np.polyfit(x, sv[:, j], 1)[0])
        if len(scatter) < N_SCATTER:
            scatter[s] = {"bits": bits[:, j].astype(int).tolist(), "corrected": corrected[:, j].tolist(),
                          "shap": sv[:, j].astype(float).tolist()}
    return {"units": "change in predicted log-KL per doubling of the slot's bits (SHAP slope; < 0: more bits "
                     "help)", "slope": slope, "scatter": scatter}
