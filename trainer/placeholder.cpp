// placeholder, replaced as the layer lands
