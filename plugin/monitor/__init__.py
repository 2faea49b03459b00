"""What a person watches while a job trains: each step's numbers (:mod:`.record`, measured by :mod:`.meter`), the
console line (:mod:`.console`), the ``--metrics`` JSON lines (:mod:`.metrics`), TensorBoard (:mod:`.tensorboard`), the
pictures (:mod:`.plot`: loss and lr against step; :mod:`.rank_map`: which GPU holds which part), the engines'
chatter kept out of the console (:mod:`.quiet`), and a plugin refusal that ends a script said without a traceback
(:mod:`.excepthook`). Pure but for :mod:`.meter` and :mod:`.tensorboard` (torch).
"""
