-- A small shop: customers and their orders (amounts in dollars).
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     placed_on TEXT NOT NULL, amount REAL NOT NULL);
INSERT INTO customers VALUES (1, 'Ada Park', 'Lyon'), (2, 'Bruno Diaz', 'Porto'), (3, 'Chen Wei', 'Lyon'),
                             (4, 'Dana Cole', 'Oslo'), (5, 'Emeka Obi', 'Porto');
INSERT INTO orders VALUES
  (1, 1, '2024-01-14', 120.00), (2, 2, '2024-02-03', 75.50), (3, 3, '2024-03-01', 310.25),
  (4, 1, '2024-03-09', 42.00), (5, 4, '2024-03-15', 18.75), (6, 5, '2024-03-30', 260.00),
  (7, 2, '2024-04-02', 199.99), (8, 3, '2024-04-18', 12.50), (9, 5, '2024-05-05', 140.00),
  (10, 4, '2024-05-21', 88.00), (11, 1, '2024-06-11', 230.00), (12, 2, '2024-02-28', 64.00);
