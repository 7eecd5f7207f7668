"""``outrider report``: inputs recognised (``inputs``), the HTML page (``page``), and the one
plotting module (``plots``) that ``plan --plot`` draws through too. Base modules only: records are
read as JSON, never through the packages that wrote them."""
