"""The portal API's routes, one module per resource, each with its ``router``.

``common`` holds the two shapes most routes have (a page of a list, one object) and
``params`` the path and query parameters they share; :mod:`services.api.app` includes the
routers in the order of the OpenAPI document's tags.
"""
