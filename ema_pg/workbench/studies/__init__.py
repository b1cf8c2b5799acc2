"""Studies: what decides or explains a claim. ``decide`` runs a pre-registered group-sequential plan
(:mod:`.sequential` its design, :mod:`.contract` the plan's contract, :mod:`.ledger` its files); :mod:`.variance`
says where a comparison's variance comes from; :mod:`.recall` splits a search run's answers into reading and
memory; :mod:`.async_study` reads the asynchronous-anchor sweep."""
