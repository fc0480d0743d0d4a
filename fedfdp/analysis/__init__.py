"""Analysis of runs, apart from the privacy component: the optimal fairness weight λ* of FedFDP's
convergence bound (:mod:`fedfdp.analysis.lambda_star`) and the source-inference attack metrics of
FinP (:mod:`fedfdp.analysis.sia_metrics`)."""
